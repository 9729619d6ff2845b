"""Tools tests and benchmarks drive the system with: named fault points (POTLUCK_FAULTS) and link emulation (netem). The fault points are called from production code and do nothing unless the variable is set.

- ``faults``: Faults injected at named points of a real process, for tests (like torchft's FailureInjector)
- ``netem``: An emulated wide-area network inside the gRPC transport, for tests, demos and benchmarks
"""
