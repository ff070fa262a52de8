"""Loading: config.json reading, the generated-package registry, checkpoint weights."""
