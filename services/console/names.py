"""Names instead of ids: agents by name and company, people by name and company, rooms by name.

A page reads the names it needs from the Gateway once (``room_names``: the room's agents and member
companies; ``company_names``: the company's own agents and rooms) and renders every author, agent and
room with them; the id stays one click away (the copy button of templates/parts.html). What a company
may see of another company's agents is the room's rule `room-agents` (docs/rules.md): the Gateway
answers with what the Room lets it see.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc

from quayutec.v1 import common_pb2, gateway_pb2
from services.console.session import Session
from services.gateway.oidc import issuer_host

# Most agents and members a page names at once (the Gateway's largest page).
MOST = 500


def vouched(verified_by: str, company: str) -> str:
    """Whether a person's name was verified at sign-in by the company's provider, or stated by its service."""
    return f"verified by {issuer_host(verified_by)}" if verified_by else f"as stated by {company}'s service"


@dataclass(frozen=True)
class Who:
    """One author, agent or company as a page shows it: a name, the company's name, the id to copy."""

    name: str
    company: str
    id: str
    kind: str  # "agent", "person" or "company"
    known: bool = True
    # For a person: "verified by <provider>" or "as stated by <company>'s service".
    vouch: str = ""


@dataclass
class Names:
    """The names a page knows: agents (id -> Agent), companies (id -> name), rooms (id -> name)."""

    own_company_id: str
    agents: dict[str, common_pb2.Agent] = field(default_factory=dict)
    companies: dict[str, str] = field(default_factory=dict)
    rooms: dict[str, str] = field(default_factory=dict)

    def company(self, company_id: str) -> str:
        return self.companies.get(company_id) or f"company {company_id[:8]}"

    def agent(self, agent_id: str) -> Who:
        found = self.agents.get(agent_id)
        if found is None:
            return Who(f"agent {agent_id[:8]}", "not in this room now", agent_id, "agent", known=False)
        return Who(found.name, found.company_name or self.company(found.company_id), agent_id, "agent")

    def author(self, a: common_pb2.Author) -> Who:
        if a.kind == common_pb2.AUTHOR_KIND_AGENT:
            return self.agent(a.agent_id)
        company = self.company(a.company_id)
        return Who(a.person or "someone", company, a.company_id, "person", vouch=vouched(a.verified_by, company))

    def room(self, room_id: str) -> str:
        return self.rooms.get(room_id) or f"room {room_id[:8]}"

    def own(self, agent_id: str) -> bool:
        found = self.agents.get(agent_id)
        return found is not None and found.company_id == self.own_company_id

    def room_agents(self) -> list[tuple[str, list[common_pb2.Agent]]]:
        """The known agents by company, the page's own company first, each company's by name."""
        by_company: dict[str, list[common_pb2.Agent]] = {}
        for a in self.agents.values():
            by_company.setdefault(a.company_id, []).append(a)
        order = sorted(by_company, key=lambda c: (c != self.own_company_id, self.company(c).lower()))
        return [(self.company(c), sorted(by_company[c], key=lambda a: a.name.lower())) for c in order]

    def learn(self, agents: Any) -> None:
        for a in agents:
            self.agents[a.agent_id] = a
            if a.company_name:
                self.companies[a.company_id] = a.company_name


async def room_names(s: Session, room_id: str) -> Names:
    """The names of a room: every member company and its agents (as the room's rule shows them)."""
    agents, members = await asyncio.gather(
        s.call("ListAgents", gateway_pb2.ListAgentsRequest(room_id=room_id, page_size=MOST)),
        s.call("ListMembers", gateway_pb2.ListMembersRequest(room_id=room_id, page_size=MOST)),
    )
    names = Names(s.company_id, companies={s.company_id: s.company_name})
    names.companies.update({m.company_id: m.company_name for m in members.members if m.company_name})
    names.learn(agents.agents)
    return names


async def company_and_room_names(s: Session, room_ids: set[str]) -> Names:
    """The company's own names, and the agents and member companies of each room named (a room the
    company is no longer in adds nothing)."""
    names, *rooms = await asyncio.gather(
        company_names(s), *(room_names(s, r) for r in room_ids), return_exceptions=True
    )
    if isinstance(names, BaseException):
        raise names
    for room in rooms:
        if isinstance(room, Names):
            names.agents = {**room.agents, **names.agents}
            names.companies = {**room.companies, **names.companies}
        elif not (isinstance(room, grpc.aio.AioRpcError) and room.code() == grpc.StatusCode.NOT_FOUND):
            raise room
    return names


async def company_names(s: Session) -> Names:
    """The names of the company's own agents and rooms."""
    agents, rooms = await asyncio.gather(
        s.call("ListAgents", gateway_pb2.ListAgentsRequest(page_size=MOST)),
        s.call("ListRooms", gateway_pb2.ListRoomsRequest(page_size=MOST)),
    )
    names = Names(s.company_id, companies={s.company_id: s.company_name})
    names.learn(agents.agents)
    names.rooms = {r.room_id: r.name for r in rooms.rooms}
    return names
