"""Generated from proto/ by `python -m pagoda.devtools.protogen`; do not edit."""
