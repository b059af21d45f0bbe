"""What the inference commands share (eval, generate, capture, export): loading a
checkpoint's model and its config in one process, the held-out data of an eval, the
prompts of generate, and the layer outputs of capture. It sits above training/'s own files,
which never import it; the commands do."""
