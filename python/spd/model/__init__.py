"""The target model: loading, stages and their partition, decoder layers, KV caches."""
