"""Multimodal requests: images and videos through the checkpoint's own HF processor."""
