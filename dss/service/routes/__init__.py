"""The service's routes, one module per tag of the OpenAPI document."""
