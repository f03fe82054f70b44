"""Training data on the owner: rows read and batched (`batches`), class labels, instruction rows."""
