"""Pure tensor functions (no state, no nn.Module). Each fast op has a naive oracle in
`deltaserve.ops.reference` that the tests compare it against."""
