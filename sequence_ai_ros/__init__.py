"""sequence_ai_ros."""
