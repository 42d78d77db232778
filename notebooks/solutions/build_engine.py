"""Chapter 11: an engine from its config, composed from the chapters' own pieces in the order
the bytes flow."""

from minisparse.engine import Engine, low_bit, make_draft, sparse_model


def build_engine(base, tokenizer, config, calibration):
    config.check()  # what does not combine is refused before any work
    method, kind = config.method, config.draft_kind
    model, parts = base, []
    if method is not None:
        model = method.model(base, calibration, config.share)
        parts.append(method.name)
    chooses_neurons = method is not None and method.neurons
    if config.weights != "fp32" and chooses_neurons:
        model = low_bit(model, config.weights)  # first: the sparse MLPs then read int8 codes
    if chooses_neurons:
        thresholds = method.thresholds(model, calibration, config.share)
        model = sparse_model(model, thresholds, None, config.sparse_kernels)
        parts.append("sparse MLPs" if config.sparse_kernels else "masked dense MLPs")
    if config.weights != "fp32":
        if not chooses_neurons:
            model = low_bit(model, config.weights)
        parts.append(f"{config.weights} weights")
    draft = None
    if kind is not None:
        draft = make_draft(kind.name, model, calibration)  # from the finished target
        parts.append(f"{kind.name} draft, gamma {config.gamma}")
    return Engine(config, model, tokenizer, draft, description=", ".join(parts) or "dense")
