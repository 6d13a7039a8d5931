"""Device and host memory for KV blocks and adapters (FastLibra).

pool.py      the device pool: fixed-size pages owned by KV blocks or adapter rank rows
tree.py      the usage-dependency tree: adapter nodes, then cached KV blocks by prefix
swapper.py   FastLibra's cost model (Eqs. 3-6) and the swapper's marks
manager.py   the three together, with the swaps, behind what the orchestrator calls
"""
