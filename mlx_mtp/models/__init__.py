"""Model files in mlx_lm's form for models mlx_lm does not have yet (each
imports only MLX and mlx_lm)."""
