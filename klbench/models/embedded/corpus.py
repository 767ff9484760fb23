"""A generated corpus of short movie reviews: the offline stand-in for IMDB.

Every review opens with one of the prompts of `embedded_prompts` (so an RL
prompt is always an in-distribution prefix for the reference model) and then
says something positive, negative, or mixed/neutral about films, genres,
roles and aspects (plot, acting, score, pacing, ...), with intensifiers,
negations ("was not boring") and contrast clauses ("..., but the ending was
weak"). Most sentiment words are in VADER's lexicon, some are not
("gripping", "predictable"), so the reward is informative but imperfect, as a
real classifier is.

    generate_reviews(n, seed=0, positive_fraction=0.5) -> list[str]
    embedded_prompts("train" | "val") -> list[str]

Deterministic: the same arguments always give the same texts (random.Random).
"""
from __future__ import annotations

import random

# Share of reviews that are mixed (a contrast between the two polarities) or
# neutral; the rest are positive with probability `positive_fraction`.
MIXED_FRACTION = 0.15

TITLES = [
    "The Silent Harbor", "Midnight Garden", "Iron Valley", "The Last Summer", "Paper Moons",
    "Northern Lights", "The Glass House", "Red River Road", "A Winter Tale", "The Long Goodbye",
    "The Brass Compass", "The Quiet Year", "City of Dust", "Blue Horizon", "The Old Lighthouse",
    "Small Towns", "Night Train", "The Apple Orchard", "Golden Hour", "The Hidden Door",
    "Stone and Salt", "The Far Shore", "Wild Horses", "The Clockmaker", "Narrow Streets",
    "Summer of Rain", "The Second Act", "Distant Stars", "The Iron Bell", "Dark Water",
]
GENRES = [
    "drama", "comedy", "thriller", "horror film", "romance", "western", "documentary",
    "science fiction film", "musical", "war film", "animated film", "mystery", "family film",
    "crime story", "fantasy film", "period piece",
]
# (noun phrase, is_plural) so that the verb agrees
ASPECTS = [
    ("plot", False), ("story", False), ("acting", False), ("cast", False), ("script", False),
    ("dialogue", False), ("soundtrack", False), ("score", False), ("cinematography", False),
    ("pacing", False), ("ending", False), ("direction", False), ("lead actor", False),
    ("lead actress", False), ("villain", False), ("special effects", True), ("editing", False),
    ("humor", False), ("characters", True), ("visuals", True), ("camera work", False),
    ("costumes", True), ("screenplay", False), ("final act", False), ("opening scene", False),
    ("music", False), ("writing", False), ("supporting cast", False), ("action scenes", True),
    ("love story", False),
]
ROLES = [
    "the lead actor", "the lead actress", "the young star", "the supporting cast", "the villain",
    "the child actor", "the director", "the writer", "the whole cast", "the main character",
    "the hero", "the comic sidekick",
]
ADJ = {
    +1: ["great", "wonderful", "brilliant", "excellent", "superb", "beautiful", "moving", "charming",
         "delightful", "clever", "gripping", "fantastic", "touching", "hilarious", "stunning",
         "powerful", "fresh", "memorable", "amazing", "lovely", "smart", "engaging", "perfect",
         "impressive", "enjoyable", "entertaining", "heartfelt", "thrilling", "masterful", "inspired",
         "funny", "fun", "solid", "warm"],
    -1: ["terrible", "awful", "boring", "dull", "weak", "horrible", "bad", "poor", "lazy", "clumsy",
         "painful", "stupid", "messy", "bland", "annoying", "forgettable", "pointless", "ugly",
         "tedious", "disappointing", "predictable", "flat", "lifeless", "awkward", "cheap",
         "ridiculous", "wooden", "mediocre", "confusing", "shallow", "slow"],
}
NEUTRAL_ADJ = ["long", "short", "quiet", "loud", "simple", "unusual", "familiar", "different", "old-fashioned",
               "serious", "strange", "ordinary"]
ADVERBS = ["really", "truly", "incredibly", "very", "absolutely", "quite", "genuinely", "surprisingly",
           "remarkably", "extremely", "pretty", "so", "rather", "completely", "simply", "utterly"]
VERBS = {
    +1: ["loved", "enjoyed", "adored", "admired", "appreciated", "liked"],
    -1: ["hated", "disliked", "regretted", "could not stand", "was bored by", "did not like"],
}
NOUNS = {  # "a {noun}"
    +1: ["masterpiece", "gem", "joy to watch", "real treat", "pleasure", "triumph", "classic", "delight"],
    -1: ["mess", "disaster", "waste of time", "letdown", "bore", "failure", "chore to sit through", "train wreck"],
}
EFFECTS = {  # "{aspect} {effect}"
    +1: ["kept me on the edge of my seat", "made me laugh out loud", "made me smile", "stayed with me for days",
         "won me over", "gave me chills", "had me hooked", "brought tears of joy to my eyes"],
    -1: ["put me to sleep", "made me check my watch", "made me cringe", "lost me halfway through",
         "left me cold", "gave me a headache", "bored me to tears", "made me want to leave"],
}
ENDINGS = {
    +1: ["I would recommend it to anyone.", "Highly recommended.", "A must see.", "Ten out of ten.",
         "I will watch it again.", "Go see it.", "Nine out of ten.", "One of the best films of the year.",
         "Worth every minute.", "I loved every minute of it."],
    -1: ["Avoid it.", "A waste of time.", "Do not bother.", "Skip this one.", "One out of ten.",
         "I want my money back.", "Two out of ten.", "One of the worst films of the year.",
         "Not worth your time.", "What a disappointment."],
    0: ["Five out of ten.", "It is worth a look if you have nothing else to do.", "Your mileage may vary.",
        "Watch it and decide for yourself.", "Six out of ten.", "It is fine for a rainy afternoon."],
}
NEUTRAL_FACTS = [
    "It runs about two hours.", "It was released last year.", "I saw it at the cinema with my sister.",
    "It is based on a novel.", "It is set in a small town by the sea.", "The director is new to me.",
    "It is the second film in a series.", "Most of it takes place in one house.", "It is in black and white.",
    "The story follows a family over one summer.", "It was shot in the mountains.",
    "The film is told in flashbacks.", "I watched it on a long flight.", "It has a small cast.",
]
TIMES = ["last night", "last weekend", "yesterday", "on Friday", "with my family", "with my brother",
         "at the cinema", "at home", "on a whim", "twice"]

# Openers (the prompts). Film subjects and aspect subjects are followed by a
# predicate ("... was great"); only film subjects can be "a drama" or "a mess".
# Event openers are followed by a time or a reaction ("... last night, and I
# loved it"). Only aspects without a VADER score of their own appear in
# prompts ("the villain", "the love story" would bias the reward).
_PROMPT_ASPECTS = ["plot", "story", "acting", "cast", "script", "dialogue", "soundtrack", "score",
                   "cinematography", "pacing", "ending", "direction", "lead actor", "lead actress",
                   "editing", "final act", "screenplay", "camera work", "music", "writing"]
_FILM_SUBJECTS = (["The movie", "The film", "This movie", "This film"]
                  + [f"Overall, {t}" for t in TITLES] + list(TITLES))
_ASPECT_SUBJECTS = ([f"The {a}" for a in _PROMPT_ASPECTS[:12]]
                    + [f"Frankly, the {a}" for a in _PROMPT_ASPECTS[:14]]
                    + [f"The {a} in {t}" for a, t in zip(_PROMPT_ASPECTS * 2, TITLES)])
_EVENTS = (["I watched this film", "I watched this movie", "I saw this movie", "We watched this film",
            "My wife and I saw this movie", "I rented this film", "I finally watched this movie",
            "I watched this one", "We saw this film", "I caught this movie", "My brother and I watched this film"]
           + [f"I watched {t}" for t in TITLES]
           + [f"I saw {t}" for t in TITLES[::2]])
_SUBJECTS = set(_FILM_SUBJECTS) | set(_ASPECT_SUBJECTS)
_PLURAL_SUBJECTS: set[str] = set()  # every prompt aspect is singular

_N_VAL_PROMPTS = 40


def embedded_prompts(split: str) -> list[str]:
    """Short review openings with no sentiment of their own. 'train' and 'val' are disjoint."""
    prompts = sorted(_SUBJECTS | set(_EVENTS))
    random.Random(1234).shuffle(prompts)  # fixed split, independent of any corpus seed
    if split == "val":
        return prompts[:_N_VAL_PROMPTS]
    if split == "train":
        return prompts[_N_VAL_PROMPTS:]
    raise ValueError(f"embedded_prompts: unknown split {split!r}; expected 'train' or 'val'")


def _be(plural: bool, rng: random.Random, noun: bool = False) -> str:
    """A copula; "felt" only before adjectives ("felt great", not "felt a mess")."""
    if plural:
        return rng.choice(["were", "are"])
    return rng.choice(["was", "is", "turned out to be"] if noun else ["was", "is", "felt", "turned out to be"])


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"


def _adj(p: int, rng: random.Random) -> str:
    """An adjective phrase of polarity p: plain, intensified, or a negated opposite."""
    r = rng.random()
    if r < 0.45:
        return rng.choice(ADJ[p])
    if r < 0.85:
        return f"{rng.choice(ADVERBS)} {rng.choice(ADJ[p])}"
    # negation: "not boring" reads mildly positive, "not good" negative
    return f"{rng.choice(['not', 'never', 'hardly', 'not at all'])} {rng.choice(ADJ[-p])}"


def _aspect(rng: random.Random) -> tuple[str, bool]:
    return rng.choice(ASPECTS)


def _sentence(p: int, rng: random.Random) -> str:
    """One follow-up sentence of polarity p (+1 or -1)."""
    a, pl = _aspect(rng)
    a2, pl2 = _aspect(rng)
    k = rng.randrange(9)
    if k == 0:
        return f"The {a} {_be(pl, rng)} {_adj(p, rng)}."
    if k == 1:
        return f"The {a} {_be(pl, rng)} {_adj(p, rng)} and the {a2} {_be(pl2, rng)} {_adj(p, rng)}."
    if k == 2:
        return f"I {rng.choice(VERBS[p])} the {a}."
    if k == 3:
        return f"{rng.choice(ROLES).capitalize()} gave a {rng.choice(ADJ[p])} performance."
    if k == 4:
        best = "best" if p > 0 else "worst"
        return f"It is one of the {best} {_plural(rng.choice(GENRES))} I have seen {rng.choice(['in years', 'this year', 'in a long time', 'in my life'])}."
    if k == 5:
        return f"The {a} {rng.choice(EFFECTS[p])}."
    if k == 6:
        return f"What a {rng.choice(NOUNS[p])}."
    if k == 7:
        return f"Even the {a} {_be(pl, rng)} {rng.choice(ADJ[p])}."
    return f"{rng.choice(['Sadly', 'Worse', 'Also']) if p < 0 else rng.choice(['Best of all', 'Also', 'Happily'])}, the {a} {_be(pl, rng)} {_adj(p, rng)}."


def _first(opener: str, p: int, rng: random.Random) -> str:
    """The opening sentence, continuing `opener` with polarity p (0 = neutral)."""
    if opener in _SUBJECTS:
        be = _be(opener in _PLURAL_SUBJECTS, rng)
        if p == 0:
            return f"{opener} {be} {rng.choice(ADVERBS[5:]) + ' ' if rng.random() < 0.3 else ''}{rng.choice(NEUTRAL_ADJ)}."
        k = rng.randrange(4) if opener in _FILM_SUBJECTS else rng.choice([0, 3])
        if k == 0:
            return f"{opener} {be} {_adj(p, rng)}."
        if k == 1:
            return f"{opener} {_be(False, rng, noun=True)} a {rng.choice(ADJ[p])} {rng.choice(GENRES)}."
        if k == 2:
            return f"{opener} {_be(False, rng, noun=True)} a {rng.choice(NOUNS[p])}."
        return f"{opener} {be} {_adj(p, rng)}, and the {_aspect(rng)[0]} {rng.choice(EFFECTS[p])}."
    when = rng.choice(TIMES)
    if p == 0:
        return f"{opener} {when}."
    k = rng.randrange(3)
    if k == 0:
        return f"{opener} {when}, and I {rng.choice(VERBS[p])} it."
    if k == 1:
        return f"{opener} {when}. It was {_adj(p, rng)}."
    return f"{opener} {when} and it was a {rng.choice(NOUNS[p])}."


def _review(p: int, rng: random.Random, openers: list[str]) -> str:
    """p = +1 positive, -1 negative, 0 mixed or neutral."""
    opener = rng.choice(openers)
    if p != 0:
        parts = [_first(opener, p, rng)] + [_sentence(p, rng) for _ in range(rng.randrange(1, 3))]
        if rng.random() < 0.6:
            parts.append(rng.choice(ENDINGS[p]))
        return " ".join(parts)
    q = rng.choice([+1, -1])
    k = rng.randrange(3)
    if k == 0:  # contrast: one polarity, then "but" the other
        a, pl = _aspect(rng)
        head = _first(opener, q, rng)[:-1]  # drop the full stop
        parts = [f"{head}, but the {a} {_be(pl, rng)} {_adj(-q, rng)}."]
    elif k == 1:  # neutral opening, then one sentence each way
        parts = [_first(opener, 0, rng), _sentence(q, rng), _sentence(-q, rng)]
    else:  # purely neutral
        parts = [_first(opener, 0, rng), rng.choice(NEUTRAL_FACTS)]
    parts.append(rng.choice(ENDINGS[0]))
    return " ".join(parts)


def generate_reviews(n: int, seed: int = 0, positive_fraction: float = 0.5) -> list[str]:
    """n reviews; MIXED_FRACTION are mixed/neutral, the rest positive with prob `positive_fraction`."""
    if n < 0:
        raise ValueError(f"generate_reviews: n must be >= 0, got {n}")
    if not 0.0 <= positive_fraction <= 1.0:
        raise ValueError(f"generate_reviews: positive_fraction must be in [0, 1], got {positive_fraction}")
    rng = random.Random(seed)
    openers = sorted(_SUBJECTS | set(_EVENTS))  # both splits: val prompts must be in-distribution too
    out = []
    for _ in range(n):
        if rng.random() < MIXED_FRACTION:
            p = 0
        else:
            p = +1 if rng.random() < positive_fraction else -1
        out.append(_review(p, rng, openers))
    return out
