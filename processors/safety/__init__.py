"""The safety stream processor: input screening and streaming-output windows, judged by `safety_model`."""
