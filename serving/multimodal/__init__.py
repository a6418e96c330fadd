"""Image input: the media policy and fetching (media.py), decoding and hashing
(images.py). No JAX; errors are MediaErrors, which the HTTP layer answers."""
