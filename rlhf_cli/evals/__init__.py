"""Yardsticks outside the reward model (`rlhf eval`): a judge head to head (`judge`), verifiable
checks (`checks`), benchmarks through lm-evaluation-harness (`benchmarks`). Pure measurement: the
stage (`stages/eval.py`) loads the policies, generates and keeps the answers."""
