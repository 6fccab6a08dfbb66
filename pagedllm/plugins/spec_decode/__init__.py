"""Built-in spec_decode plugins (registered through the pagedllm.plugins entry point 'spec_decode')."""
