"""The example job's own reward: a function of the completion and the row's columns, kept beside the job file
(lorarl finds it there: no PYTHONPATH)."""


def score(prompt: str, completion: str, solution: str, task: str, **columns) -> float:
    """1 for the exact answer; a sort that has the right digits in the wrong order earns 0.2."""
    answer = completion.strip()
    if answer == solution:
        return 1.0
    if task == "sort" and sorted(answer) == sorted(solution):
        return 0.2
    return 0.0
