"""Developer tools outside the product: code generation (`python -m pagoda.devtools.protogen`)."""
