"""Multi-LoRA: PEFT adapters, a different one per request, many in one batch (peft.py: the adapter folders; layers.py:
the adapted layers' slots; manager.py: which adapters are resident where). The request's LoRARequest is
nanoinfer/lora_request.py, beside SamplingParams; which layers are adaptable, models/layers/adaptable.py."""
