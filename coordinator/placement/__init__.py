"""Placing stages and replicas on devices from their measured links: DT-FM's cost model and its search, live at each decision and offline (``potluck schedule``).

- ``placement``: Placing live peers on the S x R tasklet grid from their measured links (DT-FM's scheduler)
- ``scheduler``: Search for a cheap tasklet assignment: DT-FM's hybrid genetic algorithm, plus two baselines
- ``costmodel``: What a tasklet assignment costs: DT-FM's communication model (Yuan et al., NeurIPS 2022)
- ``layouts``: Start layouts for the tasklet search: the blocks layout, random assignments, two greedy seeds, and structured seeds that keep pipeline segments inside the places (boxes, data centers, regions) read off the measured links
- ``moves``: The tasklet search's operators (:mod:`potluck.coordinator.placement.scheduler`): crossover and mutation, and compound moves for its local search, which change many devices of a pair of groups at once where the single swaps it tries cross a plateau only one flat step at a time
- ``pairterms``: The pair terms of the cost model: for two groups, the bottleneck and the min-sum of the perfect matchings over their pipeline links, memoised by the groups' device tuples, and the blocks of links they are solved on
- ``paths``: The graph pieces of the cost model: bottleneck and min-sum matchings between two groups, the shortest open path through the groups (Held-Karp, exact; a heuristic above its size; a spanning-tree lower bound for pruning), and the power mean the search's soft terms use
- ``topology``: Synthetic topologies for tests and benchmarks of the tasklet scheduler
- ``schedule_cli``: ``potluck schedule``: plan stages and replicas onto devices, offline, from a topology file
"""
