"""The lexicon of the embedded movie-review task, shared by the generator (corpus.py) and the gold scorer (gold.py).

Sentence forms (lower case, one sentence per '.'):
  opinion:   CLAUSE [, but CLAUSE]             CLAUSE = SUBJECT (was|is) [not] [INTENSIFIER] ADJECTIVE
  statement: i [did not | INTENSIFIER] VERB OBJECT   e.g. "i really loved the music", "i did not like this film"
  plot:      [ADVERB ,] the [DESCRIPTOR] CHARACTER ACTION the [DESCRIPTOR] THING [PREPOSITION the PLACE]
  setting:   the story takes place in the PLACE / it is set in the PLACE
Polarity is graded per word; intensifiers scale it, negation flips and damps it, and after "but" the second clause
carries the weight (see gold.py).
"""

ADJECTIVES = {
    # positive, graded
    "superb": 1.0, "brilliant": 0.9, "wonderful": 0.9, "excellent": 0.9, "great": 0.8, "gripping": 0.7,
    "beautiful": 0.7, "delightful": 0.7, "moving": 0.7, "charming": 0.6, "impressive": 0.6, "touching": 0.6,
    "good": 0.5, "enjoyable": 0.5, "clever": 0.5, "funny": 0.5, "solid": 0.4, "nice": 0.4, "decent": 0.3,
    "fine": 0.2,
    # negative, graded
    "terrible": -1.0, "awful": -0.9, "dreadful": -0.9, "horrible": -0.9, "painful": -0.8, "boring": -0.7,
    "bad": -0.6, "tedious": -0.6, "lifeless": -0.6, "weak": -0.5, "dull": -0.5, "clumsy": -0.5, "annoying": -0.5,
    "silly": -0.4, "messy": -0.4, "forgettable": -0.4, "bland": -0.3, "slow": -0.3, "predictable": -0.3,
    "mediocre": -0.3,
}

# past form -> (base form, polarity)
VERBS = {
    "loved": ("love", 0.8), "adored": ("adore", 0.9), "enjoyed": ("enjoy", 0.6), "liked": ("like", 0.5),
    "admired": ("admire", 0.6), "appreciated": ("appreciate", 0.4), "hated": ("hate", -0.9),
    "despised": ("despise", -0.9), "disliked": ("dislike", -0.5), "regretted": ("regret", -0.6),
}

INTENSIFIERS = {
    "extremely": 1.8, "incredibly": 1.8, "truly": 1.6, "very": 1.5, "really": 1.4, "quite": 1.2, "rather": 1.1,
    "fairly": 0.8, "somewhat": 0.6, "slightly": 0.5,
}
NEGATION_FACTOR = -0.7
BUT_WEIGHTS = (0.5, 1.0)  # first clause, second clause

ASPECTS = [
    "acting", "plot", "story", "script", "dialogue", "ending", "soundtrack", "music", "cast", "direction",
    "pacing", "cinematography", "humor", "score", "editing", "lead", "villain", "hero", "visuals", "premise",
    "finale", "opening", "romance", "atmosphere", "writing", "performance", "tone", "twist", "climax", "setting",
]
FILMS = ["movie", "film", "sequel", "drama", "comedy", "thriller", "western", "musical", "documentary", "remake"]
CHARACTERS = [
    "detective", "doctor", "teacher", "soldier", "farmer", "widow", "girl", "boy", "king", "queen", "pilot",
    "sailor", "thief", "priest", "writer", "painter", "nurse", "lawyer", "stranger", "mother", "father", "sister",
    "brother", "captain", "singer", "hunter", "miner", "student", "boxer", "baker", "mayor", "sheriff",
]
DESCRIPTORS = [
    "old", "young", "tall", "quiet", "rich", "poor", "lonely", "strange", "small", "local", "retired", "famous",
    "foreign", "silent", "nervous", "former",
]
ACTIONS = [
    "finds", "loses", "hides", "steals", "buys", "sells", "opens", "burns", "carries", "follows", "visits",
    "leaves", "meets", "watches", "chases", "builds", "paints", "reads", "writes", "breaks", "fixes", "guards",
    "searches", "seeks", "discovers", "returns", "drops", "keeps", "sends", "takes",
]
THINGS = [
    "letter", "map", "key", "ring", "car", "boat", "house", "horse", "painting", "book", "photograph", "gun",
    "box", "coin", "diary", "sword", "crown", "violin", "bottle", "radio", "necklace", "lamp", "clock", "mirror",
    "suitcase", "camera", "rifle", "wallet", "notebook", "knife", "guitar",
]
PLACES = [
    "city", "village", "forest", "desert", "harbor", "castle", "hospital", "school", "church", "station", "prison",
    "farm", "mountains", "island", "river", "kitchen", "office", "hotel", "theater", "garden", "bar", "ship",
    "museum", "library", "market",
]
PREPOSITIONS = ["in", "near", "behind", "outside", "inside"]
ADVERBS = ["later", "then", "meanwhile", "eventually", "soon", "suddenly", "finally"]
COPULAS = ["was", "is"]

ASPECT_SET, FILM_SET, CHARACTER_SET = set(ASPECTS), set(FILMS), set(CHARACTERS)
DESCRIPTOR_SET, ACTION_SET, THING_SET, PLACE_SET = set(DESCRIPTORS), set(ACTIONS), set(THINGS), set(PLACES)
BASE_VERBS = {base: pol for base, pol in VERBS.values()}


def vocabulary() -> set[str]:
    """Every word the grammar can produce."""
    words = set(ADJECTIVES) | set(VERBS) | set(BASE_VERBS) | set(INTENSIFIERS) | ASPECT_SET | FILM_SET
    words |= CHARACTER_SET | DESCRIPTOR_SET | ACTION_SET | THING_SET | PLACE_SET | set(PREPOSITIONS) | set(ADVERBS)
    words |= {"the", "this", "it", "was", "is", "not", "but", "i", "did", "story", "takes", "place", "set", "in"}
    return words
