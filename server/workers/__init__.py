"""Model instances and the pool that runs batches on them."""
