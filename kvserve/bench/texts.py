"""Short texts for benchmark prompts, written for kvserve (no third-party text)."""

PASSAGES = (
    "A paged KV cache splits each request's keys and values into fixed-size blocks. A block table maps "
    "the request's logical blocks to physical ones, so memory is allocated as tokens arrive and freed "
    "the moment a request finishes. Nothing is reserved for tokens that may never be generated.",
    "The lighthouse keeper climbed the stairs at dusk, as she had every evening for thirty years. She "
    "wiped the great lens, trimmed the wick and watched the first beam sweep across the water. Far out, "
    "a fishing boat turned toward the harbour, its crew glad of the light.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n"
    "            total -= values[i - window]\n        if i >= window - 1:\n            out.append(total / window)\n"
    "    return out\n",
    "Continuous batching schedules work one iteration at a time. When a request finishes, its slot is "
    "given to a waiting request at the very next step instead of at the end of the whole batch, so the "
    "hardware stays busy and short requests never wait for long ones.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n        if not self.items:\n            raise IndexError('pop from empty stack')\n"
    "        return self.items.pop()\n\n    def __len__(self):\n        return len(self.items)\n",
    "The village market opened at seven. Farmers set out baskets of apples, pears and late plums; the baker "
    "arrived with bread still warm, and by eight the square was full of neighbours trading news as much "
    "as vegetables.",
)

GROUNDED_TASKS = (
    "Repeat the following text exactly, word for word:\n\n{passage}",
    "Rewrite the following text, changing nothing except replacing every 'the' with 'THE':\n\n{passage}",
    "Copy the following text and add a one-line summary at the end:\n\n{passage}",
)

OPEN_QUESTIONS = (
    "Write a short story about a robot learning to paint.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Describe your ideal weekend in a few sentences.",
    "Explain why the sky looks blue to a ten-year-old.",
    "Give me five ideas for a birthday party theme.",
    "Write a poem about autumn leaves.",
    "What makes a good teacher? Answer in a paragraph.",
    "Invent a new board game and describe its rules.",
)

CODE_PROMPTS = (
    "Complete this Python function and explain nothing:\n\ndef is_prime(n: int) -> bool:\n    \"\"\"True if n is prime.\"\"\"\n",
    "Write a Python function `merge_sorted(a, b)` that merges two sorted lists into one sorted list.",
    "Complete this Python class:\n\nclass LRUCache:\n    def __init__(self, capacity: int):\n",
    "Write a Python function that parses a CSV line with quoted fields into a list of strings.",
)
