"""Chapter 11: what a configuration keeps in memory: its parameters and its buffers."""


def resident_bytes(model) -> int:
    tensors = {}
    for t in [*model.parameters(), *model.buffers()]:
        tensors[id(t)] = t  # a tied or shared tensor is counted once
    return sum(t.numel() * t.element_size() for t in tensors.values())
