"""Built-in implementations of rlsync's hooks: transports, buffer backends, gates."""
