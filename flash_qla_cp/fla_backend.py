"""Use flash_qla_cp through FLA's `chunk_gated_delta_rule` API.

FLA (fla-core >= 0.6) routes `fla.ops.gated_delta_rule.chunk_gated_delta_rule` through a registry
of backends, lowest priority number first. `register_fla_backend()` adds ours at priority 2,
ahead of FlashQLA's 3, so existing FLA model code runs on our kernels unchanged:

    import flash_qla_cp.fla_backend as qb
    qb.register_fla_backend()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule   # now served by flash_qla_cp

Calls that use FLA-only options (in-kernel gate or beta activation, negative eigenvalues, FLA's
own CP context) are declined and FLA falls back to its next backend. Set FLA_FLASH_QLA_CP=0 to
switch ours off without code changes.
"""

from __future__ import annotations

from .api import chunk_gated_delta_rule

BACKEND_TYPE = "flash_qla_cp"
ENV_VAR = "FLA_FLASH_QLA_CP"
PRIORITY = 2

# options of FLA's signature that ours does not implement, and the value that is harmless
_DECLINED_OPTIONS = {
    "use_beta_sigmoid_in_kernel": False,
    "allow_neg_eigval": False,
    "use_gate_in_kernel": False,
    "cp_context": None,
}
# FLA bookkeeping arguments that carry no information ours needs
_IGNORED_OPTIONS = ("chunk_indices", "transpose_state_layout")


def _split_fla_call(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                    state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **rest):
    """Bind FLA's positional order; return (our keyword arguments, FLA-only options used)."""
    ours = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    given = dict(rest, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    declined = [name for name, harmless in _DECLINED_OPTIONS.items() if given.get(name, harmless) != harmless]
    unknown = [name for name in rest if name not in _DECLINED_OPTIONS and name not in _IGNORED_OPTIONS]
    return ours, declined + unknown


def register_fla_backend(priority: int = PRIORITY) -> bool:
    """Register flash_qla_cp as a backend of FLA's gated delta rule. False if FLA is not installed."""
    try:
        from fla.backends import BaseBackend, register
    except ImportError:
        return False

    @register("gated_delta_rule")
    class FlashQLACPBackend(BaseBackend):
        """flash_qla_cp: TileLang kernels on Hopper, torch chunked path elsewhere."""

        backend_type = BACKEND_TYPE
        package_name = "flash_qla_cp"
        env_var = ENV_VAR
        default_enable = True

        def chunk_gated_delta_rule_verifier(self, *args, **kwargs):
            _, declined = _split_fla_call(*args, **kwargs)
            if declined:
                return False, f"flash_qla_cp does not implement {', '.join(declined)}"
            return True, None

        def chunk_gated_delta_rule(self, *args, **kwargs):
            ours, _ = _split_fla_call(*args, **kwargs)
            return chunk_gated_delta_rule(**ours)

    FlashQLACPBackend.priority = priority
    return True
