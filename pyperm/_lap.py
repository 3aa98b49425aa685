from pyperm.lap.warm import incremental_solver, solve_square_warm  # noqa: F401  # TEMPORARY shim for pyperm.nn; removed once nn imports pyperm.lap.warm
