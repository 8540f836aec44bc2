"""The plugin's refusal error and its message prefix, shared by the modules that refuse (no imports: validation.py
and mamba_ssm_format.py both use it, and neither imports the other for it)."""

ERROR_PREFIX = "vllm-mamba2-plugin"


class UnsupportedOptionError(ValueError):
    """An engine option or model config the plugin refuses (rather than silently ignoring)."""
