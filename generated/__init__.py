"""Generated model packages, one per spec. Files below are written by xllm-gen; do not edit."""
