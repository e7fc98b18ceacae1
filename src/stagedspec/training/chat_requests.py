"""General prose and chat requests for self-distillation: what users ask a chat model besides code.

A draft learns best from the oracle's own replies to the kind of request it
will serve (EAGLE's later work, Medusa-2).  The offline corpus (the stdlib's
sources and Python docs) is almost all code, so a draft trained on it alone
has never seen the oracle tell a story or give advice.  These requests are
made here, offline, from a fixed list of subjects and request forms; the
oracle's replies to them (`distill --chat-samples N`) are the training text.

None of them is a benchmark prompt: `bench.prompts.PROSE` and `CHAT` are held
out, and every subject that one of them names is left out of the list
(`held_out_words`; `tests/test_distill.py` checks the result).
"""

from __future__ import annotations

import random
import re

# Request forms: prose (continuous text) and chat (a conversational reply), as users phrase them.
PROSE_FORMS = (
    "Write a short story about {s}.",
    "Write a few paragraphs describing {s}.",
    "Explain {s} to a curious teenager.",
    "Write a blog post introduction about {s}.",
    "Write a persuasive paragraph about the importance of {s}.",
    "Describe {s} as if you were a travel writer.",
    "Write a short history of {s}.",
    "Write a diary entry by someone experiencing {s} for the first time.",
)
CHAT_FORMS = (
    "Can you tell me a bit about {s}?",
    "What are a few tips for {s}?",
    "I'm curious about {s}. Where should I start?",
    "What are the pros and cons of {s}?",
    "My friend keeps talking about {s}. Can you explain it simply?",
    "What mistakes do beginners make with {s}?",
    "Could you give me a quick overview of {s}?",
    "How would you explain {s} in three sentences?",
)
SUBJECTS = (
    "learning a second language", "growing tomatoes on a balcony", "the life of honeybees", "volcanoes",
    "saving money on groceries", "training a puppy", "the first trip to the moon", "ancient Roman roads",
    "keeping a houseplant alive", "running a first marathon", "the northern lights", "coral reefs",
    "writing a good resume", "moving to a new city", "the invention of the printing press", "public speaking",
    "playing chess", "composting at home", "the migration of birds", "painting with watercolours",
    "photography for beginners", "the water cycle in deserts", "jazz music", "the history of tea",
    "renewable energy", "building a campfire safely", "the deep ocean", "learning to swim as an adult",
    "the Silk Road", "recycling plastics", "electric cars", "keeping a journal", "the Great Wall of China",
    "meditation", "volunteering", "board games with friends", "the history of chocolate", "earthquakes",
    "a visit to an art museum", "learning to play the guitar", "urban gardening", "the solar system",
    "fixing a flat tyre", "making new friends as an adult", "the history of the printing of maps",
    "a long train journey across a continent", "the Olympic games", "sourdough baking", "whales",
    "budgeting for a holiday", "knitting", "the Renaissance", "a snowy winter in the city",
    "starting a small business", "time management for students", "the history of the internet",
    "wild mushrooms", "tides and the moon", "caring for an elderly parent", "the history of aviation",
    "a village festival", "desert animals", "choosing a first car", "ancient Egypt", "birdwatching",
    "the benefits of walking", "a rainy afternoon in a café", "bees and pollination", "camping with children",
    "the Amazon river", "learning to draw", "the history of writing", "a quiet evening at home",
    "preparing for a job interview", "the stars used for navigation", "glaciers", "a first day at school",
    "street food around the world", "saving energy at home", "the history of clocks", "dinosaurs",
    "living on a small boat", "a family road trip", "the life of an octopus", "vintage furniture",
    "writing poetry", "the history of football", "a thunderstorm over the sea", "trees in cities",
    "learning to ski", "the invention of the telephone", "the Arctic tundra", "planning a wedding",
    "getting started with running", "the history of paper", "a harbour at dawn", "rivers and their deltas",
)
# Words of the held-out benchmark prompts: a subject containing one is never asked about.
HELD_OUT_WORDS = ("lighthouse", "bottle", "market", "librar", "rain forms", "mountain village", "bicycle",
                  "seasons", "northern forest", "mystery", "night train", "cook", "hiking", "sleep",
                  "meeting", "virus", "bacteri", "birthday", "sky", "focus", "working from home")


def held_out_words() -> tuple[str, ...]:
    """The words a subject must not contain (the held-out bench prompts' subjects)."""
    return HELD_OUT_WORDS


def general_requests(n: int, seed: int = 0) -> list[str]:
    """`n` distinct prose and chat requests (alternating kinds, a seeded order of subjects and forms)."""
    subjects = [s for s in SUBJECTS if not any(w in s.lower() for w in HELD_OUT_WORDS)]
    pairs = [(f, s) for s in subjects for f in PROSE_FORMS + CHAT_FORMS]
    rng = random.Random(seed + 104729)
    rng.shuffle(pairs)
    prose = [f.format(s=s) for f, s in pairs if f in PROSE_FORMS]
    chat = [f.format(s=s) for f, s in pairs if f in CHAT_FORMS]
    out = [r for both in zip(prose, chat) for r in both]
    return [re.sub(r"\s+", " ", r) for r in out[:n]]
