"""Chapter 03: TEAL's calibration: per site and layer, the magnitude below which a share s of the
activations lies on calibration text, read from streaming statistics fed by forward hooks."""

import torch

# the module whose output each site is, in one layer of the model
SITE_MODULES = {
    "attn_in": lambda layer: layer.attn_in_act,  # normed input of q/k/v
    "mlp_in": lambda layer: layer.mlp_in_act,  # normed input of gate/up
    "mlp_act": lambda layer: layer.mlp.act,  # act(W_gate x)
    "down_in": lambda layer: layer.mlp.down_in_act,  # act(W_gate x) * W_up x
}


def calibrate(model, token_batches, sparsities, sites, SiteStats):
    c = model.config
    widths = {"attn_in": c.dim, "mlp_in": c.dim, "mlp_act": c.ffn_dim, "down_in": c.ffn_dim}
    stats = {site: [SiteStats(widths[site]) for _ in model.layers] for site in sites}
    handles = []
    for site in sites:
        for layer, summary in zip(model.layers, stats[site], strict=True):
            # the default argument binds this layer's summary (a closure would see the last one)
            def hook(module, inputs, output, summary=summary):
                summary.update(output)

            handles.append(SITE_MODULES[site](layer).register_forward_hook(hook))
    try:
        with torch.no_grad():
            for chunk in token_batches.split(4):  # a few rows at a time: bounded memory
                model(chunk)
    finally:
        for handle in handles:
            handle.remove()
    return {
        s: {site: [summary.quantile(s) for summary in stats[site]] for site in sites}
        for s in sparsities
    }
