"""What a run tells: the log line and its figures, W&B and TensorBoard, progress and the end-of-run
summary, profiles and timelines."""
