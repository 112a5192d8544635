"""Moving the trainer's weights to the engines."""
