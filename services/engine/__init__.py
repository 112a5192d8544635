"""The built-in SGLang-compatible engine."""
