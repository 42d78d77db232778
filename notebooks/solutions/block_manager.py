"""Chapter 02: a paged KV cache's bookkeeping (vLLM): block tables, reference counts,
blocks allocated on demand and copy-on-write for prefixes shared by a fork."""


class BlockManager:
    def __init__(self, n_blocks, block_size):
        self.block_size = block_size
        self.free = list(range(n_blocks))  # physical blocks nobody uses
        self.refs = [0] * n_blocks  # how many sequences point at each block
        self.tables = {}  # sequence id -> its physical blocks, in logical order
        self.next_id = 0

    def _take(self):
        if not self.free:
            raise MemoryError("no free block left")
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _drop(self, block):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def add_sequence(self):
        seq = self.next_id
        self.next_id += 1
        self.tables[seq] = []
        return seq

    def fork(self, seq):
        child = self.add_sequence()
        self.tables[child] = list(self.tables[seq])  # same blocks, not copies
        for block in self.tables[child]:
            self.refs[block] += 1
        return child

    def free_sequence(self, seq):
        for block in self.tables.pop(seq):
            self._drop(block)

    def table(self, seq):
        return self.tables[seq]

    def prepare_write(self, seq, start, end):
        table = self.tables[seq]
        while len(table) * self.block_size < end:  # blocks on demand
            table.append(self._take())
        copies = []
        for i in range(start // self.block_size, (end - 1) // self.block_size + 1):
            if self.refs[table[i]] > 1:  # shared with a fork: copy before writing
                fresh = self._take()
                copies.append((table[i], fresh))
                self._drop(table[i])
                table[i] = fresh
        return copies
