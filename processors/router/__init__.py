"""Model router: requested model + tenant tier + load of each worker group -> an inference topic."""
