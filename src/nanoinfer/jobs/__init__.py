"""Jobs: the line runner (JSONL lines through an engine), Ray replicas and their dispatcher, the Ray Data predictor."""
