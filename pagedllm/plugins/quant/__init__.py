"""Built-in quant plugins (registered through the pagedllm.plugins entry point 'quant')."""
