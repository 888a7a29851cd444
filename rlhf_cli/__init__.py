"""rlhf-cli: the four-stage RLHF pipeline (SFT, reward model, PPO, reward-hacking audit) from one
YAML recipe.

"The guide" in docstrings and messages is the PPO tutorial this project implements, cited by its
Parts 1-12 (clipped surrogate Part 3, full loss Part 4, GAE Part 5, the four models Part 6, the
KL penalty Part 7, metrics Part 9, the audit Part 10, merging Part 11, common mistakes Part 12);
README.md, "The guide", names its parts.
"""
