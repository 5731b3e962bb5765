"""How a model is spread over ranks: one file per strategy (ddp, fsdp) and the wrapping around them."""
