"""The tiny FLUX of the CPU unit tests (hidden 256, 2 heads, 2 double + 2 single blocks, narrow text/vector widths),
as a FluxParams dict for core/models/synthetic.py. Imports nothing, so a process that loaded the plugin through
ComfyUI can build it with that copy of the plugin."""
TINY = dict(image_model="flux", in_channels=16, out_channels=16, patch_size=2, mlp_ratio=4.0, theta=10000,
            qkv_bias=True, axes_dim=[16, 56, 56], num_heads=2, hidden_size=256, context_in_dim=64, vec_in_dim=64,
            depth=2, depth_single_blocks=2, guidance_embed=True)

# the same tiny sizes in the other FLUX architectures ComfyUI builds from the same blocks
TINY_FILL = {**TINY, "in_channels": 96}  # FLUX.1 Fill: 16 latent + 16 masked-image + 64 mask channels in
TINY_FLUX2 = dict(image_model="flux2", in_channels=128, out_channels=128, patch_size=1, mlp_ratio=3.0, theta=2000,
                  qkv_bias=False, axes_dim=[32, 32, 32, 32], num_heads=2, hidden_size=256, context_in_dim=64,
                  vec_in_dim=None, depth=2, depth_single_blocks=2, guidance_embed=True, global_modulation=True,
                  mlp_silu_act=True, ops_bias=False, default_ref_method="index", ref_index_scale=10.0,
                  txt_ids_dims=[3])
TINY_CHROMA = dict(image_model="chroma", in_channels=64, out_channels=64, patch_size=2, mlp_ratio=4.0, theta=10000,
                   qkv_bias=True, axes_dim=[16, 56, 56], num_heads=2, hidden_size=256, context_in_dim=64,
                   vec_in_dim=None, in_dim=64, out_dim=256, hidden_dim=256, n_layers=2, depth=2,
                   depth_single_blocks=2)
