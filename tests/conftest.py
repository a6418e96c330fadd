import os

# Tests run on the CPU; keep JAX from grabbing a GPU if one happens to be present.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
