"""What runs in the trainer process: the threads tfray starts and what they share."""
