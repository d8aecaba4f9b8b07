"""Multi-LoRA: PEFT adapters, a different one per request, many in one batch (request.py: LoRARequest; peft.py: the
adapter folders; layers.py: the adapted layers' slots; manager.py: which adapters are resident where)."""
