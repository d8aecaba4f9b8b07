"""Model families, one file each, named after the Hugging Face `model_type` (llama.py, gemma2.py, phi3.py, ...).

    registry.py   HF architectures / model_type and GGUF architectures -> family class, imported lazily
    spec.py       ModelSpec: what the engine, memory planning and the roofline read of a model (per-layer
                  attention shapes, parameter counts), computed by each family from its config
    config.py     config.json -> the config object (fast path without transformers where that is exact)
    layers/       shared building blocks: norms, rotary, embeddings, parallel linears, attention, MLP, decoder
    weights/      weight formats: safetensors and GGUF, into the model through the layers' weight loaders

docs/adding-a-model.md walks through adding a family.
"""
