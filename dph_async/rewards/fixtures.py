"""A small text-to-SQL fixture made from code: three sqlite databases, questions with gold queries.

    python -m dph_async.rewards.fixtures examples/sql

writes, under the directory:
- databases/<db_id>/<db_id>.sqlite  (BIRD/Spider layout: point `rewards.sql.db_root` here)
- sql_fixture.parquet               (verl/DPH-RL rows: prompt, data_source, reward_model, extra_info)
- responses.jsonl                   (example responses to score: right, wrong, partly right, hostile)

Everything is deterministic, so the shipped copy under examples/sql can be checked against this code.
"""

from __future__ import annotations

import json
import random
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYSTEM_PROMPT = (
    "You are a careful data analyst. Given a SQLite database schema and a question, write one SQLite "
    "query that answers it. Reply with the query in a ```sql fenced block."
)

FIRST = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kemal", "Lena"]
CITIES = ["Lyon", "Oslo", "Porto", "Quito", "Riga", "Seoul"]


@dataclass(frozen=True)
class Question:
    db_id: str
    question: str
    gold_sql: str
    data_source: str  # "bird" or "spider": which comparison the sample asks for


def _school(conn: sqlite3.Connection, rng: random.Random) -> None:
    conn.executescript("""
        CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT, year INTEGER);
        CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT NOT NULL, credits INTEGER);
        CREATE TABLE enrollments (student_id INTEGER REFERENCES students(id),
                                  course_id INTEGER REFERENCES courses(id), score REAL);
    """)
    conn.executemany("INSERT INTO students VALUES (?, ?, ?, ?)",
                     [(i + 1, name, CITIES[i % len(CITIES)], rng.randint(1, 4))
                      for i, name in enumerate(FIRST)])
    courses = ["Algebra", "Biology", "Chemistry", "Databases", "Economics"]
    conn.executemany("INSERT INTO courses VALUES (?, ?, ?)",
                     [(i + 1, title, rng.choice([3, 4, 6])) for i, title in enumerate(courses)])
    rows = [(s, c, round(rng.uniform(40, 100), 1))
            for s in range(1, len(FIRST) + 1) for c in range(1, len(courses) + 1) if rng.random() < 0.6]
    conn.executemany("INSERT INTO enrollments VALUES (?, ?, ?)", rows)


def _shop(conn: sqlite3.Connection, rng: random.Random) -> None:
    conn.executescript("""
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT);
        CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT, price REAL);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
                             product_id INTEGER REFERENCES products(id), quantity INTEGER, day TEXT);
    """)
    countries = ["France", "Norway", "Portugal", "Korea"]
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?)",
                     [(i + 1, name, rng.choice(countries)) for i, name in enumerate(FIRST[:8])])
    products = [("lamp", "home"), ("kettle", "home"), ("novel", "books"), ("atlas", "books"),
                ("scarf", "clothes"), ("boots", "clothes")]
    conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?)",
                     [(i + 1, name, category, rng.choice([9.5, 12.0, 25.0, 40.0]))
                      for i, (name, category) in enumerate(products)])
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
                     # Customers 7 and 8 never order.
                     [(i + 1, rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 5),
                       f"2024-{i % 12 + 1:02d}-{rng.randint(1, 28):02d}") for i in range(40)])


def _flights(conn: sqlite3.Connection, rng: random.Random) -> None:
    conn.executescript("""
        CREATE TABLE airports (code TEXT PRIMARY KEY, city TEXT NOT NULL, country TEXT);
        CREATE TABLE flights (id INTEGER PRIMARY KEY, origin TEXT REFERENCES airports(code),
                              destination TEXT REFERENCES airports(code), airline TEXT, distance INTEGER);
    """)
    airports = [("LYS", "Lyon", "France"), ("OSL", "Oslo", "Norway"), ("OPO", "Porto", "Portugal"),
                ("UIO", "Quito", "Ecuador"), ("RIX", "Riga", "Latvia"), ("ICN", "Seoul", "Korea")]
    conn.executemany("INSERT INTO airports VALUES (?, ?, ?)", airports)
    codes = [a[0] for a in airports]
    flights = []
    for i in range(30):
        origin, destination = rng.sample(codes, 2)
        flights.append((i + 1, origin, destination, rng.choice(["Aurora", "Boreal", "Cielo"]),
                        rng.randint(300, 9000)))
    conn.executemany("INSERT INTO flights VALUES (?, ?, ?, ?, ?)", flights)


DATABASES = {"school": _school, "shop": _shop, "flights": _flights}

QUESTIONS = [
    Question("school", "How many students are there?", "SELECT COUNT(*) FROM students", "bird"),
    Question("school", "List the names of students who live in Oslo.",
             "SELECT name FROM students WHERE city = 'Oslo'", "bird"),
    Question("school", "What is the average score in the Databases course?",
             "SELECT AVG(e.score) FROM enrollments e JOIN courses c ON e.course_id = c.id "
             "WHERE c.title = 'Databases'", "bird"),
    Question("school", "For each course title, how many students are enrolled? Order by title.",
             "SELECT c.title, COUNT(*) FROM courses c JOIN enrollments e ON e.course_id = c.id "
             "GROUP BY c.title ORDER BY c.title", "spider"),
    Question("school", "Which students scored above 90 in any course? Give distinct names.",
             "SELECT DISTINCT s.name FROM students s JOIN enrollments e ON e.student_id = s.id "
             "WHERE e.score > 90", "spider"),
    Question("school", "Give the name and year of every student in year 4.",
             "SELECT name, year FROM students WHERE year = 4", "spider"),
    Question("school", "What is the highest score ever recorded?",
             "SELECT MAX(score) FROM enrollments", "bird"),
    Question("school", "How many courses are worth 6 credits?",
             "SELECT COUNT(*) FROM courses WHERE credits = 6", "spider"),
    Question("shop", "How many orders were placed in total?", "SELECT COUNT(*) FROM orders", "bird"),
    Question("shop", "List the names of products in the books category.",
             "SELECT name FROM products WHERE category = 'books'", "bird"),
    Question("shop", "What is the total quantity ordered by customers from Norway?",
             "SELECT SUM(o.quantity) FROM orders o JOIN customers c ON o.customer_id = c.id "
             "WHERE c.country = 'Norway'", "bird"),
    Question("shop", "For each country, how many customers are there? Order by the count, then country.",
             "SELECT country, COUNT(*) FROM customers GROUP BY country ORDER BY COUNT(*), country", "spider"),
    Question("shop", "Which customers never placed an order?",
             "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)", "spider"),
    Question("shop", "Give the name and price of the most expensive products.",
             "SELECT name, price FROM products WHERE price = (SELECT MAX(price) FROM products)", "bird"),
    Question("shop", "What is the revenue (quantity times price) of each product category?",
             "SELECT p.category, SUM(o.quantity * p.price) FROM orders o "
             "JOIN products p ON o.product_id = p.id GROUP BY p.category", "spider"),
    Question("shop", "How many orders were placed in December 2024?",
             "SELECT COUNT(*) FROM orders WHERE day LIKE '2024-12-%'", "bird"),
    Question("flights", "How many flights does the airline Boreal operate?",
             "SELECT COUNT(*) FROM flights WHERE airline = 'Boreal'", "bird"),
    Question("flights", "List the cities of all airports.", "SELECT city FROM airports", "bird"),
    Question("flights", "What is the longest flight distance?",
             "SELECT MAX(distance) FROM flights", "spider"),
    Question("flights", "Which cities have flights departing to Seoul? Give distinct city names.",
             "SELECT DISTINCT a.city FROM flights f JOIN airports a ON f.origin = a.code "
             "WHERE f.destination = 'ICN'", "bird"),
    Question("flights", "For each airline, give the number of flights and the average distance.",
             "SELECT airline, COUNT(*), AVG(distance) FROM flights GROUP BY airline", "spider"),
    Question("flights", "List origin and destination codes of flights longer than 8000, longest first.",
             "SELECT origin, destination FROM flights WHERE distance > 8000 "
             "ORDER BY distance DESC", "spider"),
    Question("flights", "How many airports are in countries outside Europe?",
             "SELECT COUNT(*) FROM airports WHERE country IN ('Ecuador', 'Korea')", "bird"),
    Question("flights", "Which airlines fly out of Lyon?",
             "SELECT DISTINCT f.airline FROM flights f JOIN airports a ON f.origin = a.code "
             "WHERE a.city = 'Lyon'", "spider"),
]


def _schema(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return "\n".join(sql for (sql,) in conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table'"))
    finally:
        conn.close()


def write_databases(root: Path, seed: int = 0) -> None:
    for offset, (db_id, fill) in enumerate(DATABASES.items()):
        path = root / db_id / f"{db_id}.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        conn = sqlite3.connect(path)
        fill(conn, random.Random(seed + offset))
        conn.commit()
        conn.close()


def fixture_rows(root: Path) -> list[dict]:
    """The fixture's questions as verl/DPH-RL dataset rows."""
    schemas = {db_id: _schema(root / db_id / f"{db_id}.sqlite") for db_id in DATABASES}
    rows = []
    for index, q in enumerate(QUESTIONS):
        user = f"Database schema:\n{schemas[q.db_id]}\n\nQuestion: {q.question}"
        truth = {"gold_sql": q.gold_sql, "db_id": q.db_id, "cmp_method": q.data_source}
        rows.append({
            "data_source": q.data_source,
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
            "ability": "sql",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": index, "split": "test", "db_id": q.db_id, "question": q.question},
        })
    return rows


def example_responses(rows: list[dict]) -> list[dict]:
    """Responses to score: each gold query, a wrong and a partly right one, and a few hostile ones."""
    def answer(row: dict, text: str) -> dict:
        return {"data_source": row["data_source"], "response": text,
                "reward_model": row["reward_model"], "extra_info": row["extra_info"]}

    out = []
    for row in rows:
        gold = row["reward_model"]["ground_truth"]["gold_sql"]
        out.append(answer(row, f"The query:\n```sql\n{gold}\n```"))
    first = rows[1]  # names of students in Oslo
    out += [
        answer(first, "```sql\nSELECT name FROM students WHERE city = 'Riga'\n```"),
        answer(first, "```sql\nSELECT name, city FROM students WHERE city = 'Oslo'\n```"),
        answer(first, "I am not sure."),
        answer(first, "```sql\nATTACH DATABASE 'copy.db' AS c\n```"),
        answer(first, "```sql\nSELECT 1; DROP TABLE students\n```"),
        answer(first, "```sql\nWITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) "
                      "SELECT COUNT(*) FROM r\n```"),
        answer(first, "```sql\nSELECT length(randomblob(2000000000))\n```"),
    ]
    return out


def build_sql_fixture(out_dir: Path, seed: int = 0) -> Path:
    """Write the databases, the dataset parquet and the example responses; returns the parquet path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_databases(out_dir / "databases", seed)
    rows = fixture_rows(out_dir / "databases")
    parquet = out_dir / "sql_fixture.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    with open(out_dir / "responses.jsonl", "w") as f:
        for item in example_responses(rows):
            f.write(json.dumps(item) + "\n")
    return parquet


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/sql")
    print(build_sql_fixture(target))
