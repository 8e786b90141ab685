"""Training the small default models on CPU (`deltaserve train-tiny`): the synthetic chat
curriculum (`tasks`, `curriculum`), the trainer on the model's reference forward (`trainer`) and
the export to the Hugging Face layout with MXFP4 experts (`export`). Sits beside `tiny` in the
layering: it may import model, ops, tiny and chat, never the engine."""
