"""A template Flower App for fedbayes: edit task.py (model, data, algorithm) and run `flwr run .`."""
