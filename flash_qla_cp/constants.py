"""Constants every form of the algorithm shares (torch references, host code and kernels)."""

CHUNK = 64  # tokens per chunk of the chunked (WY / UT) form

# The intra-card split's warm-up shortcut: a state damped by exp(-16) ~ 1.1e-7 (the fp32
# resolution) may be dropped. The bound
# ||prod_t exp(g_t) (I - beta_t k_t k_t^T)|| <= exp(sum g) needs beta_t ||k_t||^2 <= 2, i.e. no
# step that expands the state: the layer's l2-normalised k and sigmoid beta give that, and
# inputs without it make the recurrence itself grow without bound. g <= 0 by definition.
WARMUP_LOG_DECAY = -16.0
