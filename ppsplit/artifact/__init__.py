"""The compiled folder: its format (file names, manifest, plan fingerprint), the stage program format, and
loading. Needs torch and safetensors, never transformers; nothing read from a folder runs as code."""
