"""Weight formats (safetensors, GGUF) into a model, through its layers' weight loaders (loading.WeightLoading)."""
