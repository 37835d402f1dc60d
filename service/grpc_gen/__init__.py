"""Generated from proto/ by `python -m pagoda.service.api.protogen`; do not edit."""
