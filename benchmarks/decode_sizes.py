"""The decoder sizes the decoding benchmarks measure (decode.py, decode_profile.py, quantize.py) and their PyTorch
peer (torch_decoder.py) builds: one table both read, so neither imports the other."""
SIZES = {"tiny": dict(d_model=64, num_heads=4, d_ff=256, num_decoder_layers=2),
         "base": dict(d_model=512, num_heads=8, d_ff=2048, num_decoder_layers=6)}
VOCAB = 256
