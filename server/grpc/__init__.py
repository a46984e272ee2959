"""The gRPC front end: Triton's GRPCInferenceService over the data plane."""
