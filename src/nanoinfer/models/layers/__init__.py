"""Building blocks shared by the model families; each asks the platform (platforms/) for its op when built."""
